"""Training heads from the target's own outputs (`specdec train`): conversations, features, the
trainer and the early-exit blocks. The defaults below live here, where the CLI reads them without
loading any of it."""

# the early-exit training defaults (docs/results/provenance.md, "EXIT_LR, EXIT_EPOCHS"): on the 1.5B's 30 000
# self-answered tokens, 2 epochs at 1e-4 reached held-out agreement 0.24 at the first position, 8 epochs at 3e-4 0.48
EXIT_LR = 3e-4
EXIT_EPOCHS = 8.0
EXIT_WINDOWS = 4  # windows (whole conversations) a training update reads
