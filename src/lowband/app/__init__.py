"""The command-line application on top of the library: cli, the training loop, its config,
checkpoints, metrics, the learning-rate schedule, data, models, tasks, bench and report.
The library never imports this package."""
