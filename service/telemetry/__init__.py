"""What the service reports: Prometheus metrics, per-request metering, tracing, logging."""
