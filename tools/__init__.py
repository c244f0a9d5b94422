"""What is not a kernel or a node: the doctor, synthetic checkpoints, the headless runner, memory watch, the CLI."""
