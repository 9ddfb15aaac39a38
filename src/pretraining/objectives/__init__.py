"""One LightningModule per pretraining objective, over a shared base (`base`): next-token (`causal_lm`) and
masked-LM (`masked_lm`) over what language models share (`language_model`), and contrastive (`contrastive`).
Configs name each by its module (`pretraining.objectives.causal_lm.CausalLM`), so a run loads only its own."""
