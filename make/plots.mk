# The plots extra's verb (src/pretraining/extras/plots).
.PHONY: plot
RUN ?=

plot: install ## Learning curves as PNG: make plot RUN=logs/train/runs/<run> (or a multirun directory)
	@test -n "$(RUN)" || { echo "usage: make plot RUN=logs/train/runs/<run> or RUN=logs/train/multiruns/<sweep>"; exit 2; }
	$(BIN)/pretrain-plot $(RUN) $(ARGS)
