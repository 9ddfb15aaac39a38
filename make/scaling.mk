# The scaling extra's verbs (src/pretraining/extras/scaling).
.PHONY: ladder

ladder: install data ## Train the scaling ladder (7 widths), fit power laws and predict its last rung: logs/scaling/ladder/ladder.{json,csv,png}
	$(BIN)/pretrain-scaling ladder $(ARGS)
