"""Request and response models (decision: engine helper; chat: server helper)."""
