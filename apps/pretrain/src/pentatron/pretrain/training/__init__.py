"""The training loop's parts: configs from arguments, start-up, one step, the loop."""
