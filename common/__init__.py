"""What the broker and the workers share: the wire protocol, the model configuration, CURVE keys, process facts and errors."""
