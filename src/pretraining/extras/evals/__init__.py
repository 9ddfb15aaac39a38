"""The evaluation extra: downstream scores of the live model at validation time, from local task files, offline.

`callbacks=[default,evals]` scores the model at every validation (`callback.DownstreamEvals`) and logs
`eval/<task>/<metric>` to every logger; `pretrain-eval ckpt_path=... callbacks=evals` scores a checkpoint.
Which objective scores which kind of task (`task.EvalTask`):
- next-token: any lm-evaluation-harness task whose data is local (`harness`: the live model as an `lm_eval` LM);
- masked-LM: masked-token accuracy on held-out text (`masked_tokens`) and, when named, the same multiple-choice
  tasks, each choice scored by its pseudo-log-likelihood;
- contrastive: retrieval in the BEIR layout (`retrieval`), scored as sentence-transformers scores it.
`pretrain-evals build` writes the bundled suite (`suite`) from the default data's validation split.
Delete this folder, `configs/callbacks/evals.yaml`, `make/evals.mk` and `tests/extras/evals` to remove it.
"""
