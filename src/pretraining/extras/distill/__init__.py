"""Distillation (an extra): a student objective that learns from a frozen teacher checkpoint as well as from
the data (`objectives`), and the teacher found, verified and loaded (`teacher`). `configs/model/distill*.yaml`
and `experiment=distill_tiny` use it; delete this folder and those configs to drop it."""
