"""The MLflow store: where it is, the client and recording lease, what runs show, the model registry and promotion."""
