"""Models: loading and saving the policy (policy.py), presets, architecture facts and the catalog (shapes.py),
LoRA rules and compute, the fused head and log-probs under a model, value and reward models, and what
`trainfit train` runs (runnable.py). Nothing here imports the planner or the trainer."""
