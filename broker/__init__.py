"""The broker side: frontend, routing, backend, supervision, metrics. Never tokenizes."""
