"""What a script's main() does once its flags are checked: train, or predict the run instead.

The estimator (the folder estimate/) is imported only here, and only when --estimate or
--check-estimate asks for it: a script copied with common/ alone trains, and parse_args refuses
both flags, saying what to copy, where estimate/ is missing.
"""


def train_or_estimate(train, args, script, argv):
    """`train(args, args.device)`; with --estimate, the run predicted on fake tensors instead
    (estimate/); with --check-estimate, on a GPU, predicted beside it too (estimate/check.py),
    the prediction recorded with the run. `script` is the script's __file__, `argv` its command
    line (None: sys.argv's)."""
    if args.estimate:
        from estimate import estimate
        return estimate(script, argv)
    if args.check_estimate:  # started now, read when the run reports (common/summary.py)
        from estimate.check import check_estimate
        args = type(args)(**vars(args), estimate_check=check_estimate(script, argv, args.device))
    return train(args, args.device)
