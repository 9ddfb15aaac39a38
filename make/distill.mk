# The distillation extra's verb (src/pretraining/extras/distill; its benchmark, scripts/bench/bench_distill.py).
.PHONY: bench-distill

bench-distill: install data ## A quarter-size student distilled from a trained clm_tiny vs the same student from scratch: bits per byte, KL to the teacher
	$(BIN)/python scripts/bench/bench_distill.py --data $(DATA_DIR) $(ARGS)
