"""Training: schedules, losses, optimizer, train state, jit/pmap steps, the loop."""
