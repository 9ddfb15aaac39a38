# The evaluation extra's verb (src/pretraining/extras/evals).
.PHONY: evals
EVALS_DIR ?= data/evals

evals: install data $(EVALS_DIR)/suite.json ## Build the bundled evaluation suite from the default data's validation split (callbacks=[default,evals] reads it)

# Rebuilt when the shards or the code that draws the items change.
$(EVALS_DIR)/suite.json: $(DATA_DIR)/manifest.json $(PAIRS_DIR)/manifest.json src/pretraining/extras/evals/build.py src/pretraining/extras/evals/bundled.py | $(VENV)/.installed
	$(BIN)/pretrain-evals build --data $(DATA_DIR) --pairs $(PAIRS_DIR) --out $(EVALS_DIR) $(ARGS)
