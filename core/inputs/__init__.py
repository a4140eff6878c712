"""What the tool reads from outside (files, environment values) and how its commands end:
the reading layer (`reading`) and the error boundary of every entry point (`boundary`)."""
