"""The worker process: its gRPC servicer (WorkerService) around the AsyncEngine, and the
conversion between the contract and the engine's types."""
