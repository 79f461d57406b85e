"""The units of work a step carries: a decision request (decision_work: its state machine; decisions: its
plan; readout: its answers) and a chat completion (chat, generation, chat_options)."""
