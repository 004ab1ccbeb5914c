"""Building blocks of the models, each usable and tested alone."""
