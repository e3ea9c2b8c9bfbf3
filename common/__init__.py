"""What the broker and the workers share: the wire protocol, configuration and errors."""
