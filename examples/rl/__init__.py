"""An RL weight loop run end to end: a trainer writing steps, two servers kept on the newest, traffic, faults."""
