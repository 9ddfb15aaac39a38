# The scaling extra's verbs (src/pretraining/extras/scaling).
.PHONY: ladder

ladder: install data ## Train the scaling ladder (5 shapes), fit power laws, predict a 6th, train it: logs/scaling/ladder/ladder.{json,csv,png}
	$(BIN)/pretrain-scaling ladder $(ARGS)
