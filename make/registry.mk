# The registry extra's verb (src/pretraining/extras/registry).
.PHONY: registry

registry: install ## The model registry: make registry ARGS="list" (register CKPT, show REF, promote REF ALIAS, taint REF --why ..., rollback ALIAS, history ALIAS, mirror)
	$(BIN)/pretrain-registry $(or $(ARGS),list)
