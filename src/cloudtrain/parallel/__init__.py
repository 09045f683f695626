"""How the processes of a launch are arranged (the mesh) and how they work together."""
