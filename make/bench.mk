# The benchmark scripts' verbs (scripts/bench/).
.PHONY: bench bench-gpu bench-documents

bench: install data ## Command start-up, template overhead vs plain PyTorch, loader throughput, resume start-up and checkpoint save times
	$(BIN)/python scripts/bench/bench_startup.py
	$(BIN)/python scripts/bench/bench_overhead.py --data $(DATA_DIR) $(ARGS)
	$(BIN)/python scripts/bench/bench_resume.py --data $(DATA_DIR)

bench-gpu: install ## On one GPU: template vs plain PyTorch tokens/s, MFU and memory for GPT-2, BERT-base and a pair model
	$(BIN)/python scripts/bench/bench_gpu.py $(ARGS)

bench-documents: install data ## clm_tiny plain, with document masking and with document positions (two seeds): bits per byte, step cost
	$(BIN)/python scripts/bench/bench_documents.py --data $(DATA_DIR) --seeds 1234 1 $(ARGS)
