"""kcloak on a NATS JetStream cluster (issue 15): engine configuration and, later, cluster workers."""
