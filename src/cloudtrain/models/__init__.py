"""Models: loading one for any task, and the ordered transforms that prepare it for training."""
