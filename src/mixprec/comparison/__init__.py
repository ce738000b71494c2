"""The pieces of `mixprec compare` (mixprec/comparison/runner.py is the entry point): settings and baselines
(config), one training run (run), the output directory (outdir), figures and verdicts (summary), and
the report sections (plots)."""
