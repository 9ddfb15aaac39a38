# The sweeps extra's verbs (src/pretraining/extras/sweeps).
.PHONY: sweep-optuna sweep-report
SWEEP ?=
# The Optuna search preset (configs/hparams_search/): the experiment's own (clm_modern), else its objective's (clm_tiny -> clm).
SEARCH ?= $(if $(wildcard configs/hparams_search/$(EXPERIMENT).yaml),$(EXPERIMENT),$(firstword $(subst _, ,$(EXPERIMENT))))

sweep-optuna: install data ## An Optuna search (configs/hparams_search/: the experiment's own, else its objective's: SEARCH=clm for clm_tiny); run again to continue
	$(BIN)/pretrain -m experiment=$(EXPERIMENT) hparams_search=$(SEARCH) $(ARGS)

sweep-report: install ## A sweep's jobs ranked, as report.md/report.csv and plots/overlay.png: make sweep-report SWEEP=<dir>
	@test -n "$(SWEEP)" || { echo "usage: make sweep-report SWEEP=logs/train/multiruns/<sweep>"; exit 2; }
	$(BIN)/pretrain-sweep-report $(SWEEP)
