"""`dspark-flow train`: make a DSpark or DFlash drafter for the model a user actually runs.

recipe.py (what to train, validated) -> data.py (self-distilled samples, cached on disk) ->
trainer.py (MLX loop: frozen target online for features, blocks.py anchors/masks, forward.py
batched drafter pass, losses.py) -> export.py (the published checkpoint layout) -> evaluate.py
(real τ with the product's own speculative loop, per category).
"""
