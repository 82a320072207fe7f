"""The operator's commands: the vkvagent command line, replay and its plot, and the demo."""
