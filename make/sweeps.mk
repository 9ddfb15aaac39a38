# The sweeps extra's verbs (src/pretraining/extras/sweeps).
.PHONY: sweep-optuna sweep-report
SWEEP ?=
# The Optuna search preset (configs/hparams_search/) of the experiment's objective: clm_tiny -> clm.
SEARCH ?= $(firstword $(subst _, ,$(EXPERIMENT)))

sweep-optuna: install data ## An Optuna search (configs/hparams_search/, by objective: SEARCH=clm for clm_modern); run again to continue
	$(BIN)/pretrain -m experiment=$(EXPERIMENT) hparams_search=$(SEARCH) $(ARGS)

sweep-report: install ## A sweep's jobs ranked, as report.md/report.csv and plots/overlay.png: make sweep-report SWEEP=<dir>
	@test -n "$(SWEEP)" || { echo "usage: make sweep-report SWEEP=logs/train/multiruns/<sweep>"; exit 2; }
	$(BIN)/pretrain-sweep-report $(SWEEP)
