"""routekit: rewrite the graph of any block-stacked PyTorch model for cheaper training."""
