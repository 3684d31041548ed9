"""The runs not made, each written to the byte of the run it stands for: a whole model's trace from
probes of a few periods of its blocks, any micro-batch size's from runs at a few sizes, and the
runs kept on disk from earlier estimates."""
