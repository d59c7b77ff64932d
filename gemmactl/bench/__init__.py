"""`gemmactl bench`: speed measured the way a caller waits for it, side by side with alternatives.

stats.py is the arithmetic on recorded timestamps, prompts.py the built-in prompt sets,
targets.py what can be measured (gemmactl's streaming core and the alternatives; the llama-server
process and client live in gemmactl/llamacpp/server.py), runner.py the order of the runs, manifest.py
what a result must say to be reproduced, report.py the table, JSON and plot.
"""
