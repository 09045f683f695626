"""cloudtrain: fine-tune Hugging Face sequence classifiers locally, on many GPUs, or on SageMaker."""

__version__ = "0.1.0"
