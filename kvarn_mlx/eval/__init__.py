"""How close a quantized KV cache stays to full precision (python -m kvarn_mlx.eval).

runner.py        text, chunked runs, attention modes, metadata, writing results
methods.py       method names -> caches, bytes held
baselines.py     tile caches quantizing another way, on KVarNCache's token flow
fidelity.py      teacher-forced logits vs the plain cache, per context length
accumulation.py  attention-output error by position, accumulated vs static
decode.py        greedy decoding: first divergence, per-step KL
longgen.py       long greedy generation from questions: KL, agreement, first divergence
retrieval.py     passkey / multi-key needle retrieval by depth and context length
tasks.py         HumanEval pass@1 per cache, batched, paired against the plain cache
sandbox.py       running model-written code against its tests, fenced in
paired.py        exact paired statistics: McNemar, Clopper-Pearson difference interval
__main__.py      the command line
"""
