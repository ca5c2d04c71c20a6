"""Accuracy: the step time and memory the planner predicts against what the runners measure."""
