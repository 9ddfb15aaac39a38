"""The linear probe (an extra): after each validation, how linearly the frozen model's features separate labels
it was never trained on (`callback.py`, `callbacks=[default,probe]`), with labels taken from the data
(`labels.py`). Delete this folder and `configs/callbacks/probe.yaml` to drop it."""
