"""Running a numbered script's own main() on fake tensors, its helpers that need data, a network or
other processes stood in for (estimate/contract.py names them), PyTorch helped where fake tensors
need it, and what the run allocated recorded in order."""
