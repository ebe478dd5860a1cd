"""Models: which one is under test and the one loader every stage uses, and the embedded reference model's training and skill figures."""
