"""What a run tells the world: job events, progress bars, TensorBoard, and quieted library noise."""
