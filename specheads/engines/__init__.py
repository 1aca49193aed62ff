"""The engines in the loop: vLLM and SGLang load and run our exports with their own code (CPU).

`venvs` creates each engine's own virtualenv once; `probe_<engine>.py` runs inside it (standalone:
it never imports specheads); `check` compares what the engine computed with specheads' own code.
"""
