"""Parts of ``recipes/train.py``: its config schemas (``config``), the model (``llama``), token data
(``tokens``), checkpoints (``checkpoint``), pipeline parallelism (``pipeline``) and what a user
sees of a run (``report``).

A package, not loose modules next to the recipe, so that running the recipe does not put
modules named ``tokens`` or ``report`` at the top of the import path.
"""
