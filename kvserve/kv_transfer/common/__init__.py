"""What the connectors between instances share: the Mooncake loader, the block wire format, store keys."""
