"""Publishing: the saved model's files, the model card, and pushes to the Hugging Face Hub."""
