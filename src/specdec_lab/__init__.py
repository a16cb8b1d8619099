"""The lab: what the benchmarks, the scripts and the tests measure policies with, kept out of the
product. Nothing in `specdec` imports it (tests/test_layers.py), and the distribution does not
install it (pyproject.toml packages specdec alone); it is importable from a checkout, where
`pip install -e .` puts src/ on the path.

    replay     drafting policies replayed offline on recorded greedy outputs (scripts/replay_controller.py)
    synthetic  drafters with a known acceptance rate, for the tests and the benchmarks
    helpers    a cost report's one-row curve as a list; the paired ratio of sums
"""
