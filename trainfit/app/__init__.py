"""The command line and what only it reaches: `trainfit` (cli.py) and its commands (plan_commands, env_commands,
doctor/, serve/, export, dryrun). The top layer: it may import every other layer, and none imports it."""
