# The Hugging Face extra's verb (src/pretraining/extras/hf).
.PHONY: export
OUT ?=

export: install ## A Hugging Face model directory: make export CKPT=path/to/last.ckpt OUT=exports/<name>
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "usage: make export CKPT=logs/train/runs/<run>/checkpoints/last.ckpt OUT=exports/<name>"; exit 2; }
	$(BIN)/pretrain-export $(CKPT) $(OUT) $(ARGS)
