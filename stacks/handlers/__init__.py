"""Lambda handlers shipped as a CDK asset (this folder only; boto3 comes with the Lambda runtime)."""
