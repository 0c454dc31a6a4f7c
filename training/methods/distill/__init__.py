"""Distillation: the teacher (teacher.py), the student's objective (objective.py) and its config section (schema.py)."""
