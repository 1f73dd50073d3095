"""Reading a checkpoint for one rank: its plan, read order, read-ahead, handover and loading in place."""
