"""The worker side: loads tokenizers, keeps the caches, answers jobs. Never routes."""
